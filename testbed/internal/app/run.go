package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"bmeg.dev/testbed/internal/config"
	"bmeg.dev/testbed/internal/rpc"
	"bmeg.dev/testbed/internal/stores"
	"bmeg.dev/testbed/internal/telemetry"
)

// callTimeout bounds one call to a peer.
const callTimeout = 10 * time.Second

// oldStoresGrace is how long replaced stores stay open for the calls still using them.
const oldStoresGrace = 2 * callTimeout

// Run serves the service configured in the file at path until ctx ends or SIGTERM/SIGINT
// arrives; SIGHUP re-reads the file and applies workers, queue_limit, cache_items, peers and
// db_pool (new store pools; the old ones close once their calls are done).
func Run(ctx context.Context, path string, log *slog.Logger) error {
	cfg, svc, err := Load(path)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	shutdownTracing, err := telemetry.Setup(ctx, cfg.Service, cfg.Instance, cfg.OTLPEndpoint)
	if err != nil {
		ln.Close()
		return err
	}
	p := &process{svc: svc, cfg: cfg, log: log, env: &Env{
		Service: cfg.Service, Instance: cfg.Instance,
		Peers: rpc.NewClient(cfg.Peers, callTimeout),
		Posts: stores.NewLRU[int64, Post](cfg.CacheItems),
	}}
	p.srv = rpc.NewServer(rpc.NewPool(cfg.Workers, cfg.QueueLimit), p.health, p.stats)
	svc.Register(p.env, p.srv)

	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	httpSrv := &http.Server{Handler: p.srv.Handler(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- httpSrv.Serve(ln) }()
	go p.openStores(ctx)
	log.Info("serving", "service", cfg.Service, "listen", cfg.Listen, "workers", cfg.Workers,
		"db_pool", cfg.DBPool, "cache_items", cfg.CacheItems)

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	for {
		select {
		case <-hup:
			p.reload(ctx, path)
			continue
		case err = <-served:
		case <-ctx.Done():
		}
		break
	}
	shutCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = errors.Join(ignoreClosed(err), httpSrv.Shutdown(shutCtx))
	if st := p.env.Stores(); st != nil {
		st.Close()
	}
	return errors.Join(err, shutdownTracing(shutCtx)) // flushes the spans still batched
}

// Load reads a service's configuration and checks it names a known service with the peers
// and stores that service needs.
func Load(path string) (*config.Config, Service, error) {
	cfg, err := config.Load(path)
	if err != nil {
		return nil, Service{}, err
	}
	svc, err := Lookup(cfg.Service)
	if err == nil {
		err = svc.Check(cfg)
	}
	if err != nil {
		return nil, Service{}, fmt.Errorf("config %s: %w", path, err)
	}
	return cfg, svc, nil
}

func ignoreClosed(err error) error {
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// process is a running service.
type process struct {
	svc Service
	env *Env
	srv *rpc.Server
	log *slog.Logger

	mu  sync.Mutex
	cfg *config.Config
}

func (p *process) config() *config.Config {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cfg
}

// openStores connects (retrying every second until the stores answer: the runtime may start
// them after the services), creates the tables, and opens the readiness gate.
func (p *process) openStores(ctx context.Context) {
	for attempt := 0; ; attempt++ {
		st, err := stores.Open(ctx, p.svc.StoreSpec(p.config()))
		if err == nil {
			if err = p.createSchema(ctx, st); err == nil {
				p.env.SetStores(st)
				p.srv.SetReady()
				p.log.Info("ready", "attempts", attempt+1)
				return
			}
			st.Close()
		}
		if attempt%10 == 0 {
			p.log.Warn("stores not ready, retrying", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

// createSchema runs the service's CREATE ... IF NOT EXISTS statements. Two services creating
// the same table at once can collide in PostgreSQL's catalog; the caller retries.
func (p *process) createSchema(ctx context.Context, st *stores.Stores) error {
	if st.Postgres == nil {
		return nil
	}
	for _, stmt := range p.svc.Schema {
		if _, err := st.Postgres.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("schema: %w", err)
		}
	}
	return nil
}

func (p *process) reload(ctx context.Context, path string) {
	next, _, err := Load(path)
	if err == nil && (next.Service != p.cfg.Service || next.Listen != p.cfg.Listen) {
		err = errors.New(`"service" and "listen" change only with a restart`)
	}
	if err != nil {
		p.log.Error("reload rejected, keeping the running configuration", "error", err)
		return
	}
	prev := p.config()
	p.srv.Pool.Resize(next.Workers, next.QueueLimit)
	p.env.Posts.Resize(next.CacheItems)
	p.env.Peers.SetPeers(next.Peers)
	if p.svc.StoreSpec(next) != p.svc.StoreSpec(prev) && p.env.Stores() != nil {
		st, err := stores.Open(ctx, p.svc.StoreSpec(next))
		if err != nil {
			p.log.Error("reload: new stores failed, keeping the old ones", "error", err)
			next.DBPool = prev.DBPool
		} else {
			old := p.env.SetStores(st)
			time.AfterFunc(oldStoresGrace, old.Close)
		}
	}
	p.mu.Lock()
	p.cfg = next
	p.mu.Unlock()
	p.log.Info("reloaded", "workers", next.Workers, "queue_limit", next.QueueLimit, "db_pool", next.DBPool,
		"cache_items", next.CacheItems)
}

func (p *process) health(ctx context.Context) error {
	st := p.env.Stores()
	if st == nil {
		return errors.New("stores not open")
	}
	return st.Ping(ctx)
}

func (p *process) stats() any {
	c := p.config()
	out := map[string]any{"service": c.Service, "instance": c.Instance, "workers": c.Workers,
		"queue_limit": c.QueueLimit, "db_pool": c.DBPool, "cache_items": c.CacheItems, "peers": c.Peers}
	if p.svc.Cache {
		out["cache"] = p.env.Posts.Stats()
	}
	return out
}
