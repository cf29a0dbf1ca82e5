"""Classroom assignments made from this repository: `python -m classroom handout OUT`,
`python -m classroom grade` and `python -m classroom autograder OUT.zip` (classroom/README.md)."""
