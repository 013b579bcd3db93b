"""Helpers the tests share (servers, kernels, browsers, raw clients); no tests live here."""
