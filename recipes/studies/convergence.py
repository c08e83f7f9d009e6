"""The study `hf_powernorm.studies.convergence` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies convergence`)."""

from hf_powernorm.studies.convergence import main

if __name__ == "__main__":
    main()
