"""The run's configuration: typed schemas and their validation.

One function per config group, and the fingerprint.
"""
