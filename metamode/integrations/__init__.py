"""Shims that route other libraries' global-patching helpers through metamode.

Each shim rebinds a library's *module-level names* -- once, atomically,
reversibly -- to metamode's thread-scoped equivalents. Classes are never
touched and nothing is patched per call. See :mod:`metamode.integrations._rebind`.
"""
