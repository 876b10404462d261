"""The version of framepipe, declared here and only here (packaging reads it from this file)."""

__version__ = "0.1.0"
