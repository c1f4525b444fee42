"""Diagnostics: the live reward-hacking monitor and the hacking lab."""
