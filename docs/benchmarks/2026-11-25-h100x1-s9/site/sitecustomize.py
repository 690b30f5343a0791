# Session 9 diagnosis: every Python process (pytest and its rank workers) dumps all its threads'
# stacks to stderr on SIGUSR1.
import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
