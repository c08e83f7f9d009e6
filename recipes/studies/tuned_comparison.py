"""The study `hf_powernorm.studies.tuned_comparison` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies tuned_comparison`)."""

from hf_powernorm.studies.tuned_comparison import main

if __name__ == "__main__":
    main()
