;;; ollie-client.el --- a small Emacs client of an olliefs mount, run in emacs --batch  -*- lexical-binding: t -*-

;; Run by tests/clients/test_emacs.py as
;;   emacs --batch -Q -l ollie-client.el -f ollie-client-run
;; with OLLIE (the mount point) and WORK (a directory for the session's cwd) in the
;; environment, and a replay script that answers the first prompt with a reply that
;; hangs after a few deltas and the second with "second answer".
;;
;; It does what an Emacs client does: files only (write-region, insert-file-contents,
;; file-attributes), no subprocess.  Chat is followed by size polling, as Emacs's own
;; auto-revert and comint-style clients do: look at the size, read the bytes past what
;; the buffer holds when it grew.  A blocking file (stream, statewait) is never read:
;; Emacs reads a file whole, and those never end.
;;
;; Any question Emacs would put to a user makes the run fail: a save that asks "changed
;; on disk; really edit the buffer?" is exactly the bug this client exists to catch.

;;; Code:

(require 'cl-lib)

(defvar ollie-client-root (or (getenv "OLLIE") (error "OLLIE is not set")))
(defvar ollie-client-work (or (getenv "WORK") (error "WORK is not set")))
(defvar ollie-client-id "emacs")

(defun ollie-client--fail-on-question (name)
  "Make the function NAME fail the run instead of asking the user."
  (advice-add name :override
              (lambda (&rest args)
                (error "Emacs asked the user: %s %S" name args))))

(dolist (f '(ask-user-about-supersession-threat ask-user-about-lock yes-or-no-p y-or-n-p
             read-answer read-char-choice))
  (ollie-client--fail-on-question f))

(defun ollie-client--path (&rest parts)
  (mapconcat #'identity (cons ollie-client-root parts) "/"))

(defun ollie-client--session (file)
  (ollie-client--path "s" ollie-client-id file))

(defun ollie-client--read (path)
  "The whole content of PATH, read as Emacs reads a file (never a blocking one)."
  (with-temp-buffer
    (set-buffer-multibyte nil)
    (insert-file-contents-literally path)
    (buffer-string)))

(defun ollie-client--write (path text)
  "Write TEXT to PATH as one save of a region, the way Emacs writes any file."
  (let ((coding-system-for-write 'utf-8-unix)
        (write-region-inhibit-fsync t))
    (write-region text nil path nil 'quiet)))

(defun ollie-client--state ()
  (string-trim (ollie-client--read (ollie-client--session "state"))))

;;;; Following chat by size polling

(defvar ollie-client-chat-buffer nil)

(defun ollie-client--poll-chat ()
  "Append what chat gained since the last look; return the number of new bytes."
  (let* ((path (ollie-client--session "chat"))
         (size (file-attribute-size (file-attributes path))))
    (with-current-buffer ollie-client-chat-buffer
      (let ((have (buffer-size)))
        (if (<= size have)
            0
          (goto-char (point-max))
          (let ((inhibit-read-only t))
            (insert-file-contents-literally path nil have size))
          (- size have))))))

(defun ollie-client--follow-until (pred what)
  "Poll chat until PRED (called in the chat buffer) holds; fail after 60 s."
  (let ((deadline (+ (float-time) 60)))
    (while (progn
             (ollie-client--poll-chat)
             (not (with-current-buffer ollie-client-chat-buffer (funcall pred))))
      (when (> (float-time) deadline)
        (error "Timed out following chat for %s; buffer: %S" what
               (with-current-buffer ollie-client-chat-buffer (buffer-string))))
      (sleep-for 0.02))))

(defun ollie-client--buffer-has (text)
  (lambda () (save-excursion (goto-char (point-min)) (search-forward text nil t))))

;;;; The run

(defun ollie-client-run-session ()
  ;; Create the session: one write to s/new.
  (ollie-client--write (ollie-client--path "s" "new")
                       (format "cwd=%s name=%s" ollie-client-work ollie-client-id))
  (unless (file-directory-p (ollie-client--session ""))
    (error "No session directory after writing s/new"))
  (setq ollie-client-chat-buffer (generate-new-buffer "*ollie-chat*"))
  (with-current-buffer ollie-client-chat-buffer (set-buffer-multibyte nil))
  ;; A prompt, then a second one queued behind the running turn through fifo.in.  The
  ;; first reply hangs, so the second is queued for sure.
  (ollie-client--write (ollie-client--session "prompt") "first question")
  (unless (equal (ollie-client--state) "thinking")
    (error "State after the prompt: %s" (ollie-client--state)))
  (ollie-client--write (ollie-client--session "fifo.in") "second question")
  (ollie-client--follow-until (ollie-client--buffer-has "assistant: partial") "the partial reply")
  (unless (equal (ollie-client--state) "thinking")
    (error "State while the reply hangs: %s" (ollie-client--state)))
  (ollie-client--write (ollie-client--session "ctl") "stop\n")
  ;; The queued prompt runs after the stop.
  (ollie-client--follow-until
   (lambda ()
     (and (funcall (ollie-client--buffer-has "assistant: second answer\n"))
          (equal (ollie-client--state) "idle")))
   "the second answer")
  (ollie-client--poll-chat)
  (let ((file (ollie-client--read (ollie-client--session "chat")))
        (buf (with-current-buffer ollie-client-chat-buffer (buffer-string))))
    (unless (equal file buf)
      (error "Buffer differs from chat:\nbuffer: %S\nfile: %S" buf file))
    (dolist (want '("user: first question\n" ":: stopped\n" "user: second question\n"))
      (unless (string-search want file)
        (error "Chat lacks %S: %S" want file)))
    (unless (< (string-search ":: stopped" file) (string-search "assistant: second answer" file))
      (error "The queued prompt ran before the stop: %S" file)))
  (message "ollie-client: chat followed, %d bytes"
           (with-current-buffer ollie-client-chat-buffer (buffer-size))))

(defun ollie-client--edit-cfg (key value)
  "Visit cfg, set KEY to VALUE in the buffer and save it, as a user does."
  (let ((buf (find-file-noselect (ollie-client--session "cfg"))))
    (with-current-buffer buf
      (goto-char (point-min))
      (unless (re-search-forward (format "^%s=.*$" (regexp-quote key)) nil t)
        (error "cfg has no %s line: %S" key (buffer-string)))
      (replace-match (format "%s=%s" key value) t t)
      (save-buffer)
      (when (buffer-modified-p)
        (error "cfg still modified after save-buffer"))
      (unless (verify-visited-file-modtime buf)
        (error "After saving, Emacs thinks cfg changed on disk")))
    buf))

(defun ollie-client-run-cfg ()
  (let ((buf (ollie-client--edit-cfg "temperature" "0.5")))
    (unless (string-search "\ntemperature=0.5\n" (ollie-client--read (ollie-client--session "cfg")))
      (error "The save did not apply: %S" (ollie-client--read (ollie-client--session "cfg"))))
    ;; A second edit of the same buffer: the save checks the file's mtime against the
    ;; one recorded at the first save, so a file whose mtime moves by itself asks here.
    (ollie-client--edit-cfg "maxTokens" "1234")
    (let ((cfg (ollie-client--read (ollie-client--session "cfg"))))
      (dolist (want '("\ntemperature=0.5\n" "\nmaxTokens=1234\n"))
        (unless (string-search want cfg)
          (error "cfg lacks %S after two saves: %S" want cfg))))
    (kill-buffer buf))
  (message "ollie-client: cfg saved twice"))

(defun ollie-client-run ()
  (ollie-client-run-session)
  (ollie-client-run-cfg)
  (message "ollie-client: ok")
  (kill-emacs 0))

;;; ollie-client.el ends here
