"""Importing memlean beside another torch version is refused with both versions named."""
import subprocess
import sys

import memlean

OTHER = "2.10.0+other"  # a torch version memlean is never built against

SCRIPT = f"""
import torch
torch.__version__ = "{OTHER}"
try:
    import memlean
except ImportError as e:
    print("IMPORT-ERROR:", e)
else:
    print("IMPORTED")
"""


def test_other_torch_version_is_an_import_error():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=None, check=True).stdout
    assert "IMPORT-ERROR:" in out, out
    assert OTHER in out and memlean._build_info.TORCH_VERSION in out, out


def test_same_public_version_imports():
    import torch
    assert memlean._build_info.TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]
    assert memlean.__version__ == memlean._build_info.VERSION


if __name__ == "__main__":
    import pytest
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
