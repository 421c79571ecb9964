// Command socialnet is the testbed application: one binary, one role per process.
//
//	socialnet service --config FILE
//	socialnet proxy --listen ADDR --upstream ADDR[,ADDR...] [--admin ADDR]
//	socialnet load --target URL --rate R --duration D [--mix compose=0.1,user=0.3,home=0.6] [--seed S] ...
//
// Exit status: 0 on success, 2 on bad usage or configuration, 1 on a failure while running.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"bmeg.dev/testbed/internal/app"
	"bmeg.dev/testbed/internal/load"
	"bmeg.dev/testbed/internal/proxy"
)

const usage = `usage:
  socialnet service --config FILE
  socialnet proxy --listen ADDR --upstream ADDR[,ADDR...] [--admin ADDR]
  socialnet load --target URL --rate R --duration D [--mix SPEC] [--seed S] [--users N]
                 [--init] [--follows K] [--posts P] [--arrivals constant|poisson] [--timeout D] [--max-in-flight N]
services: %v
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// usageError is a mistake in the command line or configuration (exit status 2).
type usageError struct{ error }

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintf(stderr, usage, app.Names())
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	var err error
	switch args[0] {
	case "service":
		err = runService(args[1:], log)
	case "proxy":
		err = runProxy(args[1:], log)
	case "load":
		err = runLoad(args[1:], stdout)
	case "-h", "--help", "help":
		fmt.Fprintf(stdout, usage, app.Names())
		return 0
	default:
		err = usageError{fmt.Errorf("unknown role %q: want service, proxy or load", args[0])}
	}
	if err == nil {
		return 0
	}
	fmt.Fprintln(stderr, "socialnet:", err)
	var ue usageError
	if errors.As(err, &ue) || errors.Is(err, flag.ErrHelp) {
		return 2
	}
	return 1
}

func parse(fs *flag.FlagSet, args []string) error {
	fs.SetOutput(io.Discard) // errors are reported once, by run
	if err := fs.Parse(args); err != nil {
		return usageError{err}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected arguments %v", fs.Args())}
	}
	return nil
}

func runService(args []string, log *slog.Logger) error {
	fs := flag.NewFlagSet("service", flag.ContinueOnError)
	path := fs.String("config", "", "service configuration (JSON)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return usageError{errors.New("service: --config FILE is required")}
	}
	if _, _, err := app.Load(*path); err != nil {
		return usageError{err}
	}
	return app.Run(context.Background(), *path, log)
}

func runProxy(args []string, log *slog.Logger) error {
	fs := flag.NewFlagSet("proxy", flag.ContinueOnError)
	listen := fs.String("listen", "", "address to accept connections on")
	upstream := fs.String("upstream", "", "address(es) to forward them to: host:port[,host:port...], requests balanced over them")
	admin := fs.String("admin", "", "address of the admin API (POST /_admin/delay)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *listen == "" || *upstream == "" {
		return usageError{errors.New("proxy: --listen and --upstream are required")}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	return proxy.Run(ctx, *listen, *upstream, *admin, log)
}

func runLoad(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("load", flag.ContinueOnError)
	o := load.Options{}
	fs.StringVar(&o.Target, "target", "", "nginx-web-server's base URL, http://host:port")
	fs.Float64Var(&o.Rate, "rate", 100, "requests per second")
	o.Duration, o.Timeout = 30*time.Second, 10*time.Second
	fs.Var((*seconds)(&o.Duration), "duration", "length of the run: seconds (60) or a Go duration (5m)")
	mix := fs.String("mix", load.DefaultMix, "request kinds and shares: compose, home, user, login, follow")
	fs.StringVar(&o.Arrivals, "arrivals", load.Constant, "constant (wrk2) or poisson")
	fs.Uint64Var(&o.Seed, "seed", 1, "random seed (users, texts, arrivals)")
	fs.IntVar(&o.Users, "users", 962, "user ids 1..N (962: DeathStarBench's socfb-Reed98 graph)")
	fs.BoolVar(&o.Init, "init", false, "register the users and their follows before the run")
	fs.IntVar(&o.Follows, "follows", 10, "followees per user registered by --init")
	fs.IntVar(&o.Posts, "posts", 0, "posts each user composes at --init, after the follows")
	fs.Var((*seconds)(&o.Timeout), "timeout", "per-request timeout: seconds or a Go duration")
	fs.IntVar(&o.MaxInFlight, "max-in-flight", 4096, "requests in flight beyond which due ones are dropped")
	if err := parse(fs, args); err != nil {
		return err
	}
	var err error
	if o.Mix, err = load.ParseMix(*mix); err != nil {
		return usageError{err}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	sum, err := load.Run(ctx, o)
	if err != nil {
		return usageError{err}
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(sum)
}

// seconds is a duration flag that also takes a plain number of seconds ("60", "0.5").
type seconds time.Duration

func (s *seconds) String() string { return time.Duration(*s).String() }

func (s *seconds) Set(v string) error {
	if d, err := time.ParseDuration(v); err == nil {
		*s = seconds(d)
		return nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return fmt.Errorf("want seconds or a duration such as 30s, got %q", v)
	}
	*s = seconds(time.Duration(f * float64(time.Second)))
	return nil
}
