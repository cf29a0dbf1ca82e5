"""python -m classroom handout OUT [--exercises E1,E3]  |  python -m classroom grade [E3] [-v]
[--hidden --seed SECRET --submission DIR] [--json PATH]"""
import argparse
import pathlib

from classroom.manifest import EXERCISES


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m classroom",
                                     description="Classroom assignments made from this repository.")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("handout", help="write a handout with the exercises blanked")
    make.add_argument("out", help="a new (or empty) directory for the handout")
    make.add_argument("--exercises", default=",".join(e.id for e in EXERCISES),
                      help="comma-separated exercise ids (default: all, E1..E8)")
    grade = commands.add_parser("grade", help="grade the handout in the current directory")
    grade.add_argument("exercises", nargs="*", help="only these exercises (e.g. E3)")
    grade.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")
    grade.add_argument("--hidden", action="store_true",
                       help="instructor: grade --submission with the hidden cases of --seed")
    grade.add_argument("--seed", type=int, help="the instructor's secret seed (with --hidden)")
    grade.add_argument("--submission", help="the student's handout directory (with --hidden)")
    grade.add_argument("--json", default="grade_results.json",
                       help="Gradescope results file (on Gradescope: "
                            "/autograder/results/results.json)")
    args = parser.parse_args(argv)
    if args.command == "handout":
        from classroom import handout

        chosen = [e.strip().upper() for e in args.exercises.split(",") if e.strip()]
        out = handout.make(pathlib.Path(args.out), chosen)
        print(f"handout with {', '.join(chosen)} written to {out} (leak check passed)")
        return out
    from classroom import grade as grading

    return grading.main(args)


if __name__ == "__main__":
    main()
