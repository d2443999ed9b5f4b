"""memlean's experiments: one module per table of the source documents."""
