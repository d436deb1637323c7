"""Definitions the tests run, in this process or in worker processes (autodiscovered)."""
