"""The test suite, a package so that its helpers import by one name (``tests.support``)."""
