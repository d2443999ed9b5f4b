"""The plugin library loads into a plain torch process and registers torch.ops.memlean.swish."""
import os
import unittest

import torch


class PluginTest(unittest.TestCase):
    def test_load_library_registers_the_op(self):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "libmemlean_swish.so")
        torch.ops.load_library(path)
        x = torch.linspace(-6, 6, 101, dtype=torch.float64, requires_grad=True)
        y = torch.ops.memlean.swish(x, 1.5)
        ref = x * torch.sigmoid(1.5 * x)
        torch.testing.assert_close(y, ref)
        (g,) = torch.autograd.grad(y.sum(), x)
        (g_ref,) = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(g, g_ref)
        self.assertEqual(str(torch.ops.memlean.swish.default._schema),
                         "memlean::swish(Tensor x, float beta=1.) -> Tensor")


if __name__ == "__main__":
    unittest.main()
