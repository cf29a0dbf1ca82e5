"""python -m classroom handout OUT [--exercises E1,E3]  |  python -m classroom grade [E3] [-v]
[--hidden --seed SECRET_INT | --seed-file PATH --submission DIR [--assignment E1,E3]]
[--json PATH]  |
python -m classroom autograder OUT.zip --exercises E1,E3 --seed SECRET_INT"""
import argparse
import pathlib

from classroom.manifest import EXERCISES

ALL = ",".join(e.id for e in EXERCISES)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m classroom",
                                     description="Classroom assignments made from this repository.")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("handout", help="write a handout with the exercises blanked")
    make.add_argument("out", help="a new (or empty) directory for the handout")
    make.add_argument("--exercises", default=ALL,
                      help="comma-separated exercise ids (default: all, E1..E8)")
    grade = commands.add_parser("grade", help="grade the handout in the current directory")
    grade.add_argument("exercises", nargs="*", help="only these exercises (e.g. E3)")
    grade.add_argument("-v", "--verbose", action="store_true",
                       help="every failing case's message, not the first few")
    grade.add_argument("--hidden", action="store_true",
                       help="instructor: grade --submission with the hidden cases of --seed")
    grade.add_argument("--seed", type=int,
                       help="the instructor's secret seed, an integer (with --hidden)")
    grade.add_argument("--seed-file",
                       help="a file holding the secret seed: unlike a command line, which every "
                            "user can read, a file only you can read (needed with --child-user)")
    grade.add_argument("--submission", help="the student's files or handout (with --hidden)")
    grade.add_argument("--assignment", help="the assignment's exercises, e.g. E1,E2,E4 (with "
                                            "--hidden; default: the submission's .classroom, "
                                            "else all)")
    grade.add_argument("--base", help=argparse.SUPPRESS)  # a prebuilt blank handout (autograder)
    grade.add_argument("--child-user", help=argparse.SUPPRESS)  # run submitted code as (root only)
    grade.add_argument("--json", default="grade_results.json",
                       help="Gradescope results file (on Gradescope: "
                            "/autograder/results/results.json)")
    zip_ = commands.add_parser("autograder", help="build a Gradescope autograder zip")
    zip_.add_argument("out", help="the zip to write, e.g. autograder.zip")
    zip_.add_argument("--exercises", default=ALL, help="the assignment's exercises (default: all)")
    zip_.add_argument("--seed", type=int, required=True,
                      help="the secret seed of the hidden cases, an integer")
    args = parser.parse_args(argv)
    here = pathlib.Path(__file__).parent
    if args.command in ("handout", "autograder") and not (here / "handout.py").is_file():
        raise SystemExit(f"`python -m classroom {args.command}` runs in the instructor's "
                         "repository, not in a handout")
    if args.command == "handout":
        from classroom import handout

        chosen = [e.strip().upper() for e in args.exercises.split(",") if e.strip()]
        out = handout.make(pathlib.Path(args.out), chosen)
        print(f"handout with {', '.join(chosen)} written to {out} (leak check passed)")
        return out
    if args.command == "autograder":
        from classroom import autograder

        chosen = [e.strip().upper() for e in args.exercises.split(",") if e.strip()]
        out = autograder.build(pathlib.Path(args.out), chosen, args.seed)
        print(f"Gradescope autograder for {', '.join(chosen)} written to {out}")
        return out
    from classroom import grade as grading

    return grading.main(args)


if __name__ == "__main__":
    main()
