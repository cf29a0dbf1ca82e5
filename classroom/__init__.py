"""Classroom assignments made from this repository: `python -m classroom handout OUT` and
`python -m classroom grade` (classroom/README.md)."""
