# bash completion for ollie(1): subcommands, their flags, and mount points.
# Installed by `ollie install-helpers` as .../bash-completion/completions/ollie (loaded
# on first use); or by hand: source this file from ~/.bashrc.
#
# umount and status complete the olliefs mounts of /proc/self/mountinfo (type
# fuse.olliefs); mount completes directories. The flags of replay-server are read from
# its --help once per shell, as that command changes on its own schedule.

_ollie_mounts() {
    # Field 5 is the mount point (octal escapes: \040 is a space); after " - ", the type.
    local line point rest
    while IFS= read -r line; do
        rest=${line#* - }
        [[ $rest == "fuse.olliefs "* ]] || continue
        point=${line#* * * * }
        point=${point%% *}
        printf '%b\n' "$point"
    done </proc/self/mountinfo
}

_ollie_replay_flags=
_ollie() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=
    ((COMP_CWORD > 0)) && prev=${COMP_WORDS[COMP_CWORD - 1]}
    local commands="mount umount status doctor build-pyfuse3 install-helpers man replay-server mcp"
    COMPREPLY=()
    if ((COMP_CWORD == 1)); then
        mapfile -t COMPREPLY < <(compgen -W "$commands -h --help" -- "$cur")
        return
    fi
    local flags= words=
    case ${COMP_WORDS[1]} in
    mount)
        flags="-f --foreground -v --verbose --toolsrv --toolsrv-key-file --9p --9p-allow-remote"
        flags+=" --9p-key-file -h --help"
        case $prev in
        --toolsrv)
            compopt -o nospace
            mapfile -t COMPREPLY < <(compgen -W "unix:" -- "$cur")
            return ;;
        --9p)
            compopt -o nospace
            mapfile -t COMPREPLY < <(compgen -W "unix: tcp:127.0.0.1:" -- "$cur")
            return ;;
        --toolsrv-key-file | --9p-key-file)
            compopt -o filenames
            mapfile -t COMPREPLY < <(compgen -f -- "$cur")
            return ;;
        esac
        if [[ $cur != -* ]]; then
            compopt -o filenames
            mapfile -t COMPREPLY < <(compgen -d -- "$cur")
            return
        fi ;;
    mcp)
        flags="--http --http-host --http-key-file -h --help"
        case $prev in
        --http | --http-host) return ;;
        --http-key-file)
            compopt -o filenames
            mapfile -t COMPREPLY < <(compgen -f -- "$cur")
            return ;;
        esac
        if [[ $cur != -* ]]; then
            compopt -o filenames
            local IFS=$'\n'
            mapfile -t COMPREPLY < <(compgen -W "$(_ollie_mounts)" -- "$cur")
            return
        fi ;;
    umount | status)
        flags="-h --help"
        if [[ $cur != -* ]]; then
            compopt -o filenames # quotes a space in a mount point
            local IFS=$'\n'
            mapfile -t COMPREPLY < <(compgen -W "$(_ollie_mounts)" -- "$cur")
            if ((${#COMPREPLY[@]} == 0)); then
                mapfile -t COMPREPLY < <(compgen -d -- "$cur")
            fi
            return
        fi ;;
    doctor | build-pyfuse3) flags="-h --help" ;;
    install-helpers)
        flags="--prefix --sbindir --user -h --help"
        case $prev in
        --prefix | --sbindir)
            compopt -o filenames
            mapfile -t COMPREPLY < <(compgen -d -- "$cur")
            return ;;
        esac ;;
    man)
        flags="--path -h --help"
        words="ollie ollie.1 ollie.5 ollie-agent ollie-agent.5 toolsrv toolsrv.8 ollie-replay
            ollie-replay.1 1 5 8" ;;
    replay-server)
        if [[ -z $_ollie_replay_flags ]]; then
            _ollie_replay_flags=$("${COMP_WORDS[0]}" replay-server --help 2>/dev/null |
                grep -oE -- '(^|[ ,[])--?[a-z][a-z0-9-]*' | grep -oE -- '--?[a-z][a-z0-9-]*' |
                sort -u | tr '\n' ' ')
        fi
        flags=$_ollie_replay_flags
        if [[ $cur != -* ]]; then
            compopt -o filenames
            mapfile -t COMPREPLY < <(compgen -f -- "$cur")
            return
        fi ;;
    *) return ;;
    esac
    if [[ $cur == -* ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$flags" -- "$cur")
    else
        mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
    fi
}
complete -F _ollie ollie
