# Sourced by bench/sim's run scripts. port_of FILE: waits (up to 60 s) for a process's first stdout
# line, {"event":"listening","port":P...} or any line with a "port" field, and prints P; exits 1
# with the file's text when none came.
port_of() {
  for _ in $(seq 600); do
    if [ -s "$1" ]; then
      p=$(head -1 "$1" | grep -o '"port": *[0-9]*' | grep -o '[0-9]*$' || true)
      [ -n "$p" ] && { echo "$p"; return; }
    fi
    sleep 0.1
  done
  echo "no port in $1: $(cat "$1")" >&2; exit 1
}
