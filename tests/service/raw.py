"""Moved to tests/_support/raw.py; this name stays until the merge points the engine's tests there."""

from tests._support.raw import RawTinker, fb_body, result, sft_datum

__all__ = ["RawTinker", "fb_body", "result", "sft_datum"]
