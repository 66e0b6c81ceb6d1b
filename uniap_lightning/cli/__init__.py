"""The ``uniap`` command: thin Hydra apps over the Python API (``plan``, ``evaluate``)."""
