"""What several test modules share: each helper in a module of its own (tests import from here,
never from one another)."""
