"""Running collectives: a schedule over the peer links (`executor.py`)."""
