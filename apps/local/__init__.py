"""`diloco run`: a job as local processes, with chaos, live progress, summary and plots."""
