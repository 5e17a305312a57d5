"""Routing policies: documents (parse, validate), gates, strategies and the policy store.

Pure logic over domain types; file reading happens only in the store's load functions.
"""
