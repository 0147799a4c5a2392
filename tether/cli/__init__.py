"""The `tether` command (``starter.py`` is its console script): ``main`` assembles the parser and
runs a command; ``output`` prints; one module per command group defines each command's options
beside its body (``runs``, ``decisions``, ``operations``, ``policy``, ``tools``, ``keys``, ``inbox``).
Nothing here imports the client, Temporal or pydantic until a command runs (``base``)."""
