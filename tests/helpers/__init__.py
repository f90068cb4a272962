"""Small programs and helpers the tests run as real processes."""
