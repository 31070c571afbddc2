#!/bin/bash
# Prints a greeting; the task is only to make this file executable.
echo ok
