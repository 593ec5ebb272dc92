"""Infrastructure every stage uses: config, errors, io, command line, torchrun, the run folder."""
