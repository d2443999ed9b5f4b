"""memlean.fit(compile=True): the budget kept by the compiled step (inductor), measured here
apart from fit; the argument checked. Apart from fit_test.py: each plan fit tries compiles
afresh, so this takes minutes under load."""
import unittest

import torch

import memlean
from fit_test import MBNet, classified, step_peak


class FitForCompileTest(unittest.TestCase):
    def test_fit_for_compile_keeps_the_budget_of_the_compiled_step(self):
        # fit(compile=True) measures every plan compiled with inductor: the compiled step,
        # measured here after a compiling step, peaks at or under the budget and equals
        # plan.peak_bytes (a quarter of the way from the least compiled peak fit reaches to
        # the compiled step's peak without checkpoints: each plan tried compiles afresh, and
        # the least budget tries several).
        model, x, loss_fn, opt = classified(MBNet, 64)
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt, compile=True)
        least = caught.exception.least_peak_bytes
        plain = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt, compile=True)
        self.assertEqual(plain.actions, [])
        self.assertLess(least, plain.peak_bytes)
        for budget in [least + (plain.peak_bytes - least) // 4]:
            plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt, compile=True)
            self.assertTrue(plan.actions, str(plan))  # below the unchanged compiled peak
            torch._dynamo.reset()
            compiled = torch.compile(model, dynamic=False)  # as fit measured it
            step_peak(compiled, (x,), loss_fn, opt)  # compiles
            measured = step_peak(compiled, (x,), loss_fn, opt)
            self.assertLessEqual(measured, budget, f"compiled: {measured} > budget {budget}\n{plan}")
            self.assertEqual(measured, plan.peak_bytes, str(plan))
            plan.undo()
        torch._dynamo.reset()

    def test_compile_argument_is_checked(self):
        model = MBNet()
        with self.assertRaisesRegex(TypeError, "compile"):
            memlean.fit(model, torch.randn(2, 3, 8, 8), 2**40, compile="inductor")


if __name__ == "__main__":
    unittest.main()
