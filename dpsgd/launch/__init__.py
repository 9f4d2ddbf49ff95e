"""The command line around a run: Hydra, sweeps and launchers.

It sits above ``dpsgd.run`` (the life of one run).

cli.py          compose a config, one-line errors and exit codes, fresh run folders
prepare.py      every check before anything is written (resume, sweep folders, overrides)
main.py         ``python -m dpsgd.train``: one run, a sweep (-m), or torchrun
info.py         its --help, before torch is imported
sweeps.py       multirun folders and their exclusive claim
launchers.py    Hydra launcher settings (joblib, submitit): jobs at once
jobfailures.py  a lost joblib/submitit job as one line
"""
