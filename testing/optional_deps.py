"""Test dependencies that an environment may lack on purpose.

A test environment made without some package names it in MEMLEAN_WITHOUT (comma-separated,
e.g. ``MEMLEAN_WITHOUT=timm,torchvision`` for torch 2.13's CPU wheel, which has no matching
torchvision on this machine). A test that needs such a package skips and says why; in every other
environment a missing package fails the test, so a machine cannot pass by skipping.
"""
import importlib
import os


def left_out():
    """The packages this environment was made without (MEMLEAN_WITHOUT)."""
    return {n.strip() for n in os.environ.get("MEMLEAN_WITHOUT", "").split(",") if n.strip()}


def available(name):
    """False when this environment was made without `name` on purpose."""
    return name not in left_out()


def require(name):
    """Imports and returns module `name`; skips the calling test if this environment was made
    without it. Call it in a test or a fixture, not at import time: memlean's test files run
    as scripts (`python x_test.py` calls pytest), where a skip outside a test is an error."""
    if not available(name):
        import pytest

        pytest.skip(f"{name}: this environment is made without it "
                    f"(MEMLEAN_WITHOUT={os.environ['MEMLEAN_WITHOUT']})")
    return importlib.import_module(name)
