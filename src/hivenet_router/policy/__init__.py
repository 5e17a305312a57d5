"""Routing policies: documents (parse, validate), gates, routing plug-ins, the step
executor and the policy store. Other layers' sections of a document are blocks they bring
(`blocks.py`), read with the same reader (`reader.py`).

Pure logic over domain types; file reading happens only in the store's load functions.
"""
