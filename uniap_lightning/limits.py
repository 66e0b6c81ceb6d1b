"""The bounds on documents the package reads (JSON and YAML): shared by :mod:`.files` and :mod:`.yaml_limits`."""

#: the largest JSON or YAML document read (plans, profiles, configs, caches are kilobytes to a few megabytes)
MAX_DOCUMENT_BYTES = 256 * 1024**2
#: the deepest nesting of lists / objects accepted in a document (the formats nest 4 or 5 levels)
MAX_NESTING_DEPTH = 64
#: the most digits of an integer in a JSON document (Python refuses to parse more than 4300 anyway)
MAX_INTEGER_DIGITS = 64
#: the most nodes a YAML document may expand to once its aliases are followed (a "billion laughs" bomb has 1e9)
MAX_YAML_NODES = 100_000
#: the most characters the ``${...}`` interpolations of a YAML document may add once resolved
MAX_YAML_INTERPOLATED_CHARS = 16 * 1024**2
