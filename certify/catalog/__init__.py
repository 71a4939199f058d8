"""The catalog: the cell files and what they ask for. ``schema`` is a cell file's pydantic schema,
``rules`` the dispatch rules over its axes, ``load`` loads and validates the files, ``plan`` lists the
certifications they ask for, ``callables`` resolves the paths they name, ``claims`` checks their
promises about tests. The package imports nothing: ``schema`` and ``rules`` are hashed into every
receipt, and only what they import joins them.
"""
