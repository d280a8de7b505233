/* reffs: the C reference of bench/perf.py, a minimal libfuse3 low-level filesystem.
 *
 * It serves the shape of olliefs's tree: a root holding s/, and s/ holding new, idx and N
 * session directories, each with the files a session has (state, chat, cfg, ...) of
 * similar sizes, with the timeouts, direct_io and keep_cache choices olliefs makes for the
 * same kind of file, given on the command line so that the bench passes the values it
 * reads from olliefs itself. Everything is fixed at start: no allocation per request, so
 * the figures are the cost of the FUSE protocol and the kernel, the floor a filesystem
 * serving this tree can reach.
 *
 * It answers flush (a no-op) because a filesystem serving this tree must: a prompt is
 * submitted when it is closed; and, where olliefs does (NOFLUSH 1), it opens read-only
 * files with FOPEN_NOFLUSH, so that their close sends no flush at all, as olliefs's
 * do. xattr operations are left out (ENOSYS), as olliefs does.
 *
 *   reffs MOUNTPOINT SESSIONS DIR_ATTR FILE_ATTR ENTRY SESSION_ENTRY DIRECT_IO KEEP_CACHE
 *         NOFLUSH
 *
 * prints "ready" on stdout once mounted and serves until unmounted (fusermount3 -u).
 */
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ROOT 1
#define SDIR 2
#define SNEW 3
#define SIDX 4
#define FIRST 16 /* inode of session 0; each session takes STRIDE inodes */
#define STRIDE 64

struct file {
	const char *name;
	int size;
	int mode;
};

/* What a session directory holds, with sizes like an idle session of olliefs. */
static const struct file files[] = {
	{"prompt", 0, 0222},      {"fifo.in", 0, 0222},   {"fifo.out", 0, 0444},
	{"plan", 0, 0666},        {"err", 0, 0444},       {"prompt.prev", 6, 0444},
	{"chat", 180, 0444},      {"stream", 180, 0444},  {"events", 120, 0444},
	{"state", 5, 0444},       {"statewait", 0, 0444}, {"cfg", 160, 0666},
	{"ctl", 0, 0222},         {"offset", 4, 0444},    {"usage", 40, 0444},
	{"cost", 12, 0444},       {"ctxsz", 24, 0444},    {"models", 60, 0444},
	{"context", 300, 0444},   {"env", 200, 0444},     {"tools", 400, 0444},
	{"systemprompt", 2000, 0444}, {"tail", 300, 0555}, {"taskstate", 2, 0444},
	{"tcct", 2, 0444},
};
#define NFILES ((int)(sizeof(files) / sizeof(files[0])))
static const char *subdirs[] = {"branches", "peer", "compactions", "t", "checkpoints", "staged"};
#define NSUB 6

static int nsessions;
static double dir_attr, file_attr, entry_ttl, session_entry_ttl;
static int direct_io, keep_cache, noflush;
static char content[4096];
static struct timespec born;

static int session_of(fuse_ino_t ino) { return (int)((ino - FIRST) / STRIDE); }
static int slot_of(fuse_ino_t ino) { return (int)((ino - FIRST) % STRIDE); }

/* Slot 0 is the session directory, 1..NFILES its files, then its sub-directories. */
static int fill(fuse_ino_t ino, struct stat *st)
{
	memset(st, 0, sizeof(*st));
	st->st_ino = ino;
	st->st_uid = getuid();
	st->st_gid = getgid();
	st->st_atim = st->st_mtim = st->st_ctim = born;
	st->st_blksize = 4096;
	if (ino == ROOT || ino == SDIR) {
		st->st_mode = S_IFDIR | 0755;
		st->st_nlink = ino == SDIR ? 2 + nsessions : 3;
		return 0;
	}
	if (ino == SNEW || ino == SIDX) {
		st->st_mode = S_IFREG | (ino == SNEW ? 0666 : 0444);
		st->st_nlink = 1;
		st->st_size = ino == SNEW ? 40 : 30 * nsessions;
		return 0;
	}
	if (ino < FIRST || session_of(ino) >= nsessions)
		return ENOENT;
	int slot = slot_of(ino);
	if (slot == 0 || slot > NFILES) {
		if (slot > NFILES + NSUB)
			return ENOENT;
		st->st_mode = S_IFDIR | 0555;
		st->st_nlink = slot == 0 ? 2 + NSUB : 2;
		return 0;
	}
	st->st_mode = S_IFREG | files[slot - 1].mode;
	st->st_nlink = 1;
	st->st_size = files[slot - 1].size;
	st->st_blocks = (st->st_size + 511) / 512;
	return 0;
}

static int is_dir(fuse_ino_t ino)
{
	if (ino == ROOT || ino == SDIR)
		return 1;
	if (ino < FIRST)
		return 0;
	int slot = slot_of(ino);
	return slot == 0 || slot > NFILES;
}

static void entry_of(fuse_ino_t ino, double ettl, struct fuse_entry_param *e)
{
	memset(e, 0, sizeof(*e));
	e->ino = ino;
	fill(ino, &e->attr);
	e->attr_timeout = is_dir(ino) ? dir_attr : file_attr;
	e->entry_timeout = ettl;
}

static long session_named(const char *name)
{
	char *end;
	if (name[0] < '0' || name[0] > '9')
		return -1;
	long n = strtol(name, &end, 10);
	if (*end || n < 0 || n >= nsessions)
		return -1;
	return n;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
	struct fuse_entry_param e;
	fuse_ino_t ino = 0;
	double ettl = entry_ttl;
	if (parent == ROOT) {
		if (!strcmp(name, "s"))
			ino = SDIR;
	} else if (parent == SDIR) {
		long n;
		if (!strcmp(name, "new"))
			ino = SNEW;
		else if (!strcmp(name, "idx"))
			ino = SIDX;
		else if ((n = session_named(name)) >= 0) {
			ino = FIRST + (fuse_ino_t)n * STRIDE;
			ettl = session_entry_ttl;
		}
	} else if (parent >= FIRST && slot_of(parent) == 0) {
		for (int i = 0; i < NFILES && !ino; i++)
			if (!strcmp(name, files[i].name))
				ino = parent + 1 + i;
		for (int i = 0; i < NSUB && !ino; i++)
			if (!strcmp(name, subdirs[i]))
				ino = parent + 1 + NFILES + i;
	}
	if (!ino) {
		fuse_reply_err(req, ENOENT);
		return;
	}
	entry_of(ino, ettl, &e);
	fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)fi;
	struct stat st;
	int err = fill(ino, &st);
	if (err)
		fuse_reply_err(req, err);
	else
		fuse_reply_attr(req, &st, is_dir(ino) ? dir_attr : file_attr);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	if (is_dir(ino)) {
		fuse_reply_err(req, EISDIR);
		return;
	}
	fi->direct_io = direct_io;
	fi->keep_cache = keep_cache;
	fi->noflush = noflush && (fi->flags & O_ACCMODE) == O_RDONLY && !(fi->flags & O_TRUNC);
	fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
		    struct fuse_file_info *fi)
{
	(void)fi;
	struct stat st;
	fill(ino, &st);
	if (off >= st.st_size)
		size = 0;
	else if ((off_t)size > st.st_size - off)
		size = (size_t)(st.st_size - off);
	fuse_reply_buf(req, content + off, size);
}

static void op_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)ino;
	(void)fi;
	fuse_reply_err(req, 0);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)ino;
	(void)fi;
	fuse_reply_err(req, 0);
}

/* One entry per offset: ".", "..", then the children in the order olliefs lists them. */
static int child(fuse_ino_t dir, off_t i, const char **name, char *buf, fuse_ino_t *ino,
		 double *ettl)
{
	*ettl = entry_ttl;
	if (i == 0) {
		*name = ".";
		*ino = dir;
		return 1;
	}
	if (i == 1) {
		*name = "..";
		*ino = dir == ROOT ? ROOT : dir == SDIR ? ROOT : SDIR;
		return 1;
	}
	i -= 2;
	if (dir == ROOT) {
		if (i != 0)
			return 0;
		*name = "s";
		*ino = SDIR;
		return 1;
	}
	if (dir == SDIR) {
		if (i == 0 || i == 1) {
			*name = i == 0 ? "new" : "idx";
			*ino = i == 0 ? SNEW : SIDX;
			return 1;
		}
		i -= 2;
		if (i >= nsessions)
			return 0;
		snprintf(buf, 32, "%04ld", (long)i);
		*name = buf;
		*ino = FIRST + (fuse_ino_t)i * STRIDE;
		*ettl = session_entry_ttl;
		return 1;
	}
	if (dir >= FIRST && slot_of(dir) == 0) {
		if (i < NFILES) {
			*name = files[i].name;
			*ino = dir + 1 + (fuse_ino_t)i;
			return 1;
		}
		if (i < NFILES + NSUB) {
			*name = subdirs[i - NFILES];
			*ino = dir + 1 + (fuse_ino_t)i;
			return 1;
		}
	}
	return 0;
}

static void op_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
			   struct fuse_file_info *fi)
{
	(void)fi;
	char *buf = malloc(size);
	size_t used = 0;
	char name_buf[32];
	const char *name;
	fuse_ino_t cino;
	double ettl;
	if (!buf) {
		fuse_reply_err(req, ENOMEM);
		return;
	}
	for (off_t i = off; child(ino, i, &name, name_buf, &cino, &ettl); i++) {
		struct fuse_entry_param e;
		entry_of(cino, ettl, &e);
		int dots = i < 2;
		if (dots)
			e.ino = 0; /* the kernel counts no lookup for . and .. */
		size_t n = fuse_add_direntry_plus(req, buf + used, size - used, name, &e, i + 1);
		if (n > size - used)
			break;
		used += n;
	}
	fuse_reply_buf(req, buf, used);
	free(buf);
}

static void op_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size)
{
	(void)ino;
	(void)name;
	(void)size;
	fuse_reply_err(req, ENOSYS);
}

static const struct fuse_lowlevel_ops ops = {
	.lookup = op_lookup,
	.getattr = op_getattr,
	.open = op_open,
	.read = op_read,
	.flush = op_flush,
	.release = op_release,
	.readdirplus = op_readdirplus,
	.getxattr = op_getxattr,
};

int main(int argc, char **argv)
{
	if (argc != 10) {
		fprintf(stderr, "usage: reffs MOUNTPOINT SESSIONS DIR_ATTR FILE_ATTR ENTRY "
				"SESSION_ENTRY DIRECT_IO KEEP_CACHE NOFLUSH\n");
		return 2;
	}
	nsessions = atoi(argv[2]);
	dir_attr = atof(argv[3]);
	file_attr = atof(argv[4]);
	entry_ttl = atof(argv[5]);
	session_entry_ttl = atof(argv[6]);
	direct_io = atoi(argv[7]);
	keep_cache = atoi(argv[8]);
	noflush = atoi(argv[9]);
	memset(content, 'x', sizeof(content));
	clock_gettime(CLOCK_REALTIME, &born);

	char *fargv[] = {argv[0], "-o", "fsname=reffs,subtype=reffs,default_permissions", NULL};
	struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
	struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
	if (!se)
		return 1;
	if (fuse_session_mount(se, argv[1])) {
		fuse_session_destroy(se);
		return 1;
	}
	printf("ready\n");
	fflush(stdout);
	int ret = fuse_session_loop(se); /* one thread, as olliefs's trio loop */
	fuse_session_unmount(se);
	fuse_session_destroy(se);
	return ret ? 1 : 0;
}
