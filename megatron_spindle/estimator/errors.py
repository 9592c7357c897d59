"""The one error type of the estimator package."""

from __future__ import annotations


class EstimatorError(ValueError):
    """Input the estimator cannot use (unknown parameter unit, invalid config, bad profile point, ...).

    The message names the offending item.
    """
