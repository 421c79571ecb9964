// Package stores opens a service's data stores with their OpenTelemetry instrumentation.
//
// Every store call is a client span of the calling service carrying db.system and
// peer.service, the name DeathStarBench gives the store ("post-storage-memcached",
// "home-timeline-redis", "user-postgres" where DeathStarBench has "user-mongodb"), so a graph
// can give the stores nodes of their own:
//   - Redis through go-redis v9 and redisotel (span per command, "zrevrange", or per pipeline);
//   - PostgreSQL through pgx v5's pool and otelpgx (spans "SELECT", "INSERT", and "pool.acquire"
//     for the wait for a pooled connection, which a pool of 1 makes long);
//   - memcached through gomemcache with spans written here (memcached has no OTel library).
//
// The connection pools hold db_pool connections: go-redis's PoolSize, pgxpool's MaxConns,
// and for memcached a semaphore in front of gomemcache (which bounds only idle connections).
package stores

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/extra/redisotel/v9"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"go.opentelemetry.io/otel/attribute"
)

// Spec says which stores to open and where.
type Spec struct {
	Service   string // the calling service, e.g. "post-storage-service"
	Redis     string
	RedisDB   int
	Memcached string
	Postgres  string
	Pool      int
}

// Stores are the open stores of a service; a store it does not use is nil.
type Stores struct {
	Redis     *redis.Client
	Memcached *Memcached
	Postgres  *pgxpool.Pool
}

// PeerName is the name a store of a service goes by in traces: "post-storage-service" with
// "memcached" gives "post-storage-memcached".
func PeerName(service, store string) string {
	return strings.TrimSuffix(service, "-service") + "-" + store
}

// Open connects to the stores of spec and checks that each answers.
func Open(ctx context.Context, spec Spec) (*Stores, error) {
	s := &Stores{}
	if spec.Redis != "" {
		s.Redis = redis.NewClient(&redis.Options{Addr: spec.Redis, DB: spec.RedisDB, PoolSize: spec.Pool,
			MinIdleConns: 1,
			// Debian 12's Redis 7.0 rejects CLIENT SETINFO and CLIENT MAINT_NOTIFICATIONS, which
			// go-redis sends on each new connection: each would be an error span.
			DisableIdentity:          true,
			MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}})
		err := redisotel.InstrumentTracing(s.Redis,
			redisotel.WithAttributes(attribute.String("peer.service", PeerName(spec.Service, "redis"))),
			redisotel.WithDialFilter(true), redisotel.WithCallerEnabled(false),
			redisotel.WithCommandFilter(untracedCommand),
			redisotel.WithCommandsFilter(func(cmds []redis.Cmder) bool {
				for _, c := range cmds {
					if !untracedCommand(c) {
						return false
					}
				}
				return true
			}))
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("redis tracing: %w", err)
		}
	}
	if spec.Memcached != "" {
		s.Memcached = NewMemcached(spec.Memcached, spec.Pool, PeerName(spec.Service, "memcached"))
	}
	if spec.Postgres != "" {
		cfg, err := pgxpool.ParseConfig(spec.Postgres)
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("postgres URL: %w", err)
		}
		cfg.MaxConns = int32(spec.Pool)
		cfg.MinConns = 1
		cfg.ConnConfig.Tracer = otelpgx.NewTracer(otelpgx.WithTracerAttributes(
			attribute.String("db.system", "postgresql"),
			attribute.String("peer.service", PeerName(spec.Service, "postgres"))))
		if s.Postgres, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
			s.Close()
			return nil, fmt.Errorf("postgres: %w", err)
		}
	}
	if err := s.Ping(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// untracedCommand leaves out of traces what is not a request's work: AUTH (as redisotel's
// default), the PING of health checks, and the HELLO/SELECT that set up a connection (as the
// dial, filtered too): made by the pool in the background, they would be one-span traces.
func untracedCommand(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "ping", "hello", "select":
		return true
	}
	return redisotel.DefaultCommandFilter(cmd)
}

// Ping checks that every open store answers.
func (s *Stores) Ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var errs []error
	if s.Redis != nil {
		if err := s.Redis.Ping(ctx).Err(); err != nil {
			errs = append(errs, fmt.Errorf("redis: %w", err))
		}
	}
	if s.Memcached != nil {
		if err := s.Memcached.Ping(); err != nil {
			errs = append(errs, fmt.Errorf("memcached: %w", err))
		}
	}
	if s.Postgres != nil {
		if err := s.Postgres.Ping(ctx); err != nil {
			errs = append(errs, fmt.Errorf("postgres: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Close closes every open store; calls still running on a pgx connection finish first.
func (s *Stores) Close() {
	if s.Redis != nil {
		_ = s.Redis.Close() // closing: an error has no one left to act on it
	}
	if s.Memcached != nil {
		_ = s.Memcached.Close()
	}
	if s.Postgres != nil {
		s.Postgres.Close()
	}
}
