"""Evaluations beyond the LM loss: synthetic recall (MQAR) and needle-in-a-haystack (NIAH)."""
