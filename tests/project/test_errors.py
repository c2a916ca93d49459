"""What ``ckptflow`` promises of its errors: every one a caller can receive is defined in
``ckptflow.errors`` and importable from the package itself."""

from __future__ import annotations

import inspect

import ckptflow
from ckptflow import errors


def test_every_error_of_ckptflow_errors_is_exported_by_the_package():
    defined = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, errors.CkptflowError) and value.__module__ == errors.__name__
    }
    assert "DcpFormatError" in defined and "LossyCopyError" in defined
    missing = sorted(name for name in defined if getattr(ckptflow, name, None) is not getattr(errors, name))
    assert not missing, f"defined in ckptflow.errors but not exported by ckptflow: {missing}"
    assert defined <= set(ckptflow.__all__)
