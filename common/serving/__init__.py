"""Talking to vLLM: starting and stopping a server, and the one chat client of 01b and 05."""
