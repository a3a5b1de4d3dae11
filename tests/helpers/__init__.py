"""Code the test modules share (tests/ is on pytest's pythonpath): no test module imports
another."""
