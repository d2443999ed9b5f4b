"""memlean's version: the one place it is written."""
VERSION = "0.1.0"
