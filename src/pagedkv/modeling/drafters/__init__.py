"""Drafter model code for speculative decoding (the draft side of ``engine.speculative``)."""
