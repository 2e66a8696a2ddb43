"""Layer 5: the pytest plugin and the IPython magic (``python -m metamode`` is ``__main__``)."""
