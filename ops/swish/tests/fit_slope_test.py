"""internal/constants.h holds a fit of the polynomials ops/swish/tools/fit_slope.py fits, and
each piece, as written in the header, is accurate well inside the in-place variant's float
bound.

The fit itself goes through numpy's LAPACK, whose last digits depend on the CPU's BLAS
kernels (AVX2 and AVX512 machines differ in the 16th digit), so the header is compared with
a fresh fit as functions, not as text; what the kernels compile is checked directly."""
import importlib.util
import os
import unittest

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ops/swish


def load_fit_slope():
    spec = importlib.util.spec_from_file_location("fit_slope",
                                                  os.path.join(HERE, "tools", "fit_slope.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FitSlopeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.fs = load_fit_slope()
        cls.data = cls.fs._data()
        with open(os.path.join(HERE, "internal/constants.h")) as f:
            cls.pieces, cls.scalars, cls.block = cls.fs.parse(f.read())
        cls.errors = cls.fs.piece_errors(cls.pieces, cls.data)

    def test_header_pieces_are_well_inside_the_float_bound(self):
        # The float gradient bound is 2e-4, of which the rounding of y near t* takes ~1.6e-4:
        # each piece of g' may add 1e-5 at most. Measured on the header's own coefficients.
        for name in ("R1", "R2", "R3", "L1", "L2"):
            self.assertLess(self.errors[name], 1e-5, name)
        # L2's error above is measured through the CPU kernel's own log; the log itself only
        # needs to be near 1e-3 (g' = u * L2(1 / log(-u)), |u| < 0.1, log(-u) < -2.3).
        self.assertLess(self.errors["LOG"], 2e-3)

    def test_header_interval_constants_are_exact(self):
        # sqrt and log of exact inputs: correctly rounded, the same on every machine.
        for name, value in self.data[2].items():
            self.assertAlmostEqual(self.scalars[name], value, delta=1e-15 * abs(value), msg=name)

    def test_header_is_the_fit_as_a_function(self):
        # A header left behind by a change of degree, split or weighting differs from the fit
        # by far more than 1e-9; LAPACK's last digits change it by ~1e-15.
        fresh = self.fs.fit_pieces(self.data)
        z = np.linspace(-1, 1, 2001)
        for name in ("R1", "R2", "L1", "L2", "LOG"):
            self.assertEqual(len(self.pieces[name]), self.fs.DEGREES[name] + 1, name)
            x = (z + 1) / 2 if name == "LOG" else z
            header = np.polynomial.polynomial.polyval(x, self.pieces[name])
            fit = np.polynomial.polynomial.polyval(x, fresh[name])
            self.assertLess(np.abs(header - fit).max(), 1e-9, name)

    def test_header_text_is_what_the_tool_writes_for_its_coefficients(self):
        # The error comment is true for the coefficients the header holds, and the block is
        # the tool's format (so a regenerated header differs only in digits).
        self.assertEqual(self.block, self.fs.render(self.pieces, self.errors, self.scalars))


if __name__ == "__main__":
    unittest.main()
