"""Errors the data plane raises; each carries the HTTP status it maps to."""

from __future__ import annotations


class InferenceError(Exception):
    """Base class: rendered as ``{"error": message}`` with ``status_code``."""

    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(InferenceError):
    status_code = 400


class ModelNotFound(InferenceError):
    status_code = 404


class VersionNotFound(InferenceError):
    status_code = 404


class PayloadTooLarge(InferenceError):
    status_code = 413


class VersionNotReady(InferenceError):
    status_code = 503


class InferenceFailed(InferenceError):
    """MNN ran but produced no output: a server-side failure."""

    status_code = 500
