"""Diagnostics: the live reward-hacking monitor (the hacking lab, which runs the trainer, is
``grpokit.lab``)."""
