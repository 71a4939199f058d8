"""The files the framework reads and writes: where a target keeps its data (``paths``), atomic writes
and directory locks (``atomic``), UTF-8 input (``utf8``), YAML with line numbers (``yamlfile``), and
the one error for bad input (``problem``).
"""
