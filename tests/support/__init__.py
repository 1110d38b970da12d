"""What tests share and is not a test: process and /proc helpers, agent processes, the TF cluster fixture's
pieces, storage targets, a test PKI, and the child-process scripts some tests run (``python -m tests.support.X``).

Test files import from here, never from one another: a test file is a list of tests, not a library.
"""
