"""Version numbers: the package release and the wire protocol."""

__version__ = "0.1.0"

#: Bumped on every incompatible change of a message kind or its fields.
PROTOCOL_VERSION = 4
