"""The run's configuration: typed schemas and their validation, one function per config group, the fingerprint."""
