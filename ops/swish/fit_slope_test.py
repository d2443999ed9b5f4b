"""swish_constants.h holds exactly the polynomials ops/swish/tools/fit_slope.py fits, and
each piece is accurate well inside the in-place variant's float bound."""
import importlib.util
import os
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def load_fit_slope():
    spec = importlib.util.spec_from_file_location("fit_slope",
                                                  os.path.join(HERE, "tools", "fit_slope.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FitSlopeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pieces, cls.errors, cls.text = load_fit_slope().fit_all()

    def test_header_matches_the_fit(self):
        with open(os.path.join(HERE, "swish_constants.h")) as f:
            header = f.read()
        begin = header.index("// BEGIN fit_slope.py output")
        end = header.index("// END fit_slope.py output") + len("// END fit_slope.py output\n")
        self.assertEqual(header[begin:end], self.text,
                         "swish_constants.h differs from tools/fit_slope.py's output: paste it in")

    def test_every_piece_is_well_inside_the_float_bound(self):
        # The float gradient bound is 2e-4, of which the rounding of y near t* takes ~1.6e-4:
        # each piece of g' may add 1e-5 at most.
        for name in ("R1", "R2", "R3", "L1", "L2"):
            self.assertLess(self.errors[name], 1e-5, name)
        # L2's error above is measured through the CPU kernel's own log; the log itself only
        # needs to be near 1e-3 (g' = u * L2(1 / log(-u)), |u| < 0.1, log(-u) < -2.3).
        self.assertLess(self.errors["LOG"], 2e-3)


if __name__ == "__main__":
    unittest.main()
