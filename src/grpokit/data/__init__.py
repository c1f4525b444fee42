"""Data: built-in synthetic tasks with exact verifiers, and readers for users' datasets."""
