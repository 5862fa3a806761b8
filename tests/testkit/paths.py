"""Where the repository and the tests' data are."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS_DATA = os.path.join(REPO, "tests", "data")
STREAM_DATA = os.path.join(TESTS_DATA, "stream")
