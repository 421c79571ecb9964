package app

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"bmeg.dev/testbed/internal/rpc"
	"bmeg.dev/testbed/internal/stores"
)

const usersTable = `CREATE TABLE IF NOT EXISTS users (user_id BIGINT PRIMARY KEY, username TEXT UNIQUE NOT NULL,
	first_name TEXT NOT NULL, last_name TEXT NOT NULL, salt TEXT NOT NULL, password_hash TEXT NOT NULL)`

// usernamePattern keeps usernames valid as memcached keys and as @mentions.
var usernamePattern = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

type userRecord struct {
	UserID       int64  `json:"user_id"`
	Username     string `json:"username"`
	FirstName    string `json:"first_name"`
	LastName     string `json:"last_name"`
	Salt         string `json:"salt"`
	PasswordHash string `json:"password_hash"`
}

func userKey(username string) string { return "user:" + username }

func passwordHash(salt, password string) string {
	sum := sha256.Sum256([]byte(salt + password))
	return hex.EncodeToString(sum[:])
}

// errNoUser is a lookup of a username nobody registered.
var errNoUser = errors.New("no such user")

// findUser reads a user from memcached, else from the users table (and fills memcached).
func findUser(ctx context.Context, st *stores.Stores, username string) (*userRecord, error) {
	if !usernamePattern.MatchString(username) {
		return nil, badRequest("username %q: use 1-64 letters, digits, _ or -", username)
	}
	var u userRecord
	v, ok, err := st.Memcached.Get(ctx, userKey(username))
	if err != nil {
		return nil, err
	}
	if ok && json.Unmarshal(v, &u) == nil {
		return &u, nil
	}
	err = st.Postgres.QueryRow(ctx, `SELECT user_id, username, first_name, last_name, salt, password_hash
		FROM users WHERE username = $1`, username).
		Scan(&u.UserID, &u.Username, &u.FirstName, &u.LastName, &u.Salt, &u.PasswordHash)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, rpc.BadRequest{Err: fmt.Errorf("%w: %q", errNoUser, username)}
	}
	if err != nil {
		return nil, fmt.Errorf("find user: %w", err)
	}
	data, _ := json.Marshal(u) // a struct of strings and ints always encodes
	return &u, st.Memcached.Set(ctx, userKey(username), data)
}

// RegisterRequest registers a user.
type RegisterRequest struct {
	UserID    int64  `json:"user_id"`
	Username  string `json:"username"`
	FirstName string `json:"first_name"`
	LastName  string `json:"last_name"`
	Password  string `json:"password"`
}

// LoginRequest checks a user's password.
type LoginRequest struct {
	Username string `json:"username"`
	Password string `json:"password"`
}

// LoginResponse carries a session token.
type LoginResponse struct {
	Token string `json:"token"`
}

// UsernameRequest names a user.
type UsernameRequest struct {
	Username string `json:"username"`
}

// UserIDResponse carries a user id.
type UserIDResponse struct {
	UserID int64 `json:"user_id"`
}

// user-service: the creator of a post (no store, as in DeathStarBench), registration (users
// table, then social-graph), login and user-id lookups (memcached, users table on a miss).
var user = Service{
	Name:     "user-service",
	Peers:    []string{"social-graph-service"},
	Memcache: true,
	Postgres: true,
	Schema:   []string{usersTable},
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "compose_creator", func(_ context.Context, r *Creator) (*Creator, error) {
			return &Creator{UserID: r.UserID, Username: r.Username}, nil
		})
		rpc.Handle(s, "register_user", func(ctx context.Context, r *RegisterRequest) (*Empty, error) {
			if r.UserID <= 0 || !usernamePattern.MatchString(r.Username) || r.Password == "" {
				return nil, badRequest("register_user needs user_id > 0, a username of 1-64 letters, digits, _ or -, and a password")
			}
			salt := randomToken(16)
			_, err := e.Stores().Postgres.Exec(ctx, `INSERT INTO users VALUES ($1, $2, $3, $4, $5, $6)
				ON CONFLICT DO NOTHING`, r.UserID, r.Username, r.FirstName, r.LastName, salt, passwordHash(salt, r.Password))
			if err != nil {
				return nil, fmt.Errorf("register user: %w", err)
			}
			return &Empty{}, e.Peers.Call(ctx, "social-graph-service", "insert_user", UserRequest{UserID: r.UserID}, nil)
		})
		rpc.Handle(s, "login", func(ctx context.Context, r *LoginRequest) (*LoginResponse, error) {
			u, err := findUser(ctx, e.Stores(), r.Username)
			if err != nil {
				return nil, err
			}
			if passwordHash(u.Salt, r.Password) != u.PasswordHash {
				return nil, badRequest("wrong password for %q", r.Username)
			}
			return &LoginResponse{Token: strconv.FormatInt(u.UserID, 10) + "." + randomToken(24)}, nil
		})
		rpc.Handle(s, "get_user_id", func(ctx context.Context, r *UsernameRequest) (*UserIDResponse, error) {
			u, err := findUser(ctx, e.Stores(), r.Username)
			if err != nil {
				return nil, err
			}
			return &UserIDResponse{UserID: u.UserID}, nil
		})
	},
}

// UserRequest names a user by id.
type UserRequest struct {
	UserID int64 `json:"user_id"`
}

// FollowRequest makes user_id follow followee_id.
type FollowRequest struct {
	UserID     int64 `json:"user_id"`
	FolloweeID int64 `json:"followee_id"`
}

// FollowNamesRequest makes user_name follow followee_name.
type FollowNamesRequest struct {
	UserName     string `json:"user_name"`
	FolloweeName string `json:"followee_name"`
}

// UserIDs is a list of user ids.
type UserIDs struct {
	UserIDs []int64 `json:"user_ids"`
}

// social-graph-service: follow edges in a table, follower and followee sets cached in Redis.
var socialGraph = Service{
	Name:     "social-graph-service",
	Peers:    []string{"user-service"},
	Redis:    true,
	Postgres: true,
	Schema: []string{
		`CREATE TABLE IF NOT EXISTS social_graph_users (user_id BIGINT PRIMARY KEY)`,
		`CREATE TABLE IF NOT EXISTS follows (follower_id BIGINT NOT NULL, followee_id BIGINT NOT NULL,
			PRIMARY KEY (follower_id, followee_id))`,
		`CREATE INDEX IF NOT EXISTS follows_followee ON follows (followee_id)`,
	},
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "insert_user", func(ctx context.Context, r *UserRequest) (*Empty, error) {
			_, err := e.Stores().Postgres.Exec(ctx, `INSERT INTO social_graph_users VALUES ($1) ON CONFLICT DO NOTHING`, r.UserID)
			if err != nil {
				return nil, fmt.Errorf("insert user: %w", err)
			}
			return &Empty{}, nil
		})
		follow := func(ctx context.Context, r *FollowRequest) (*Empty, error) {
			if r.UserID <= 0 || r.FolloweeID <= 0 || r.UserID == r.FolloweeID {
				return nil, badRequest("follow needs two different user ids > 0")
			}
			st := e.Stores()
			if _, err := st.Postgres.Exec(ctx, `INSERT INTO follows VALUES ($1, $2) ON CONFLICT DO NOTHING`,
				r.UserID, r.FolloweeID); err != nil {
				return nil, fmt.Errorf("follow: %w", err)
			}
			_, err := st.Redis.TxPipelined(ctx, func(p redis.Pipeliner) error {
				p.SAdd(ctx, followersKey(r.FolloweeID), r.UserID)
				p.SAdd(ctx, followeesKey(r.UserID), r.FolloweeID)
				return nil
			})
			return &Empty{}, err
		}
		unfollow := func(ctx context.Context, r *FollowRequest) (*Empty, error) {
			st := e.Stores()
			if _, err := st.Postgres.Exec(ctx, `DELETE FROM follows WHERE follower_id = $1 AND followee_id = $2`,
				r.UserID, r.FolloweeID); err != nil {
				return nil, fmt.Errorf("unfollow: %w", err)
			}
			_, err := st.Redis.TxPipelined(ctx, func(p redis.Pipeliner) error {
				p.SRem(ctx, followersKey(r.FolloweeID), r.UserID)
				p.SRem(ctx, followeesKey(r.UserID), r.FolloweeID)
				return nil
			})
			return &Empty{}, err
		}
		byNames := func(op func(context.Context, *FollowRequest) (*Empty, error)) func(context.Context, *FollowNamesRequest) (*Empty, error) {
			return func(ctx context.Context, r *FollowNamesRequest) (*Empty, error) {
				var a, b UserIDResponse
				err := together(
					func() error { return e.Peers.Call(ctx, "user-service", "get_user_id", UsernameRequest{r.UserName}, &a) },
					func() error {
						return e.Peers.Call(ctx, "user-service", "get_user_id", UsernameRequest{r.FolloweeName}, &b)
					})
				if err != nil {
					return nil, err
				}
				return op(ctx, &FollowRequest{UserID: a.UserID, FolloweeID: b.UserID})
			}
		}
		rpc.Handle(s, "follow", follow)
		rpc.Handle(s, "unfollow", unfollow)
		rpc.Handle(s, "follow_with_username", byNames(follow))
		rpc.Handle(s, "unfollow_with_username", byNames(unfollow))
		rpc.Handle(s, "get_followers", func(ctx context.Context, r *UserRequest) (*UserIDs, error) {
			return e.cachedSet(ctx, followersKey(r.UserID), `SELECT follower_id FROM follows WHERE followee_id = $1`, r.UserID)
		})
		rpc.Handle(s, "get_followees", func(ctx context.Context, r *UserRequest) (*UserIDs, error) {
			return e.cachedSet(ctx, followeesKey(r.UserID), `SELECT followee_id FROM follows WHERE follower_id = $1`, r.UserID)
		})
	},
}

func followersKey(id int64) string { return "followers:" + strconv.FormatInt(id, 10) }
func followeesKey(id int64) string { return "followees:" + strconv.FormatInt(id, 10) }

// cachedSet reads a set of user ids from Redis, else from the table (and fills Redis).
func (e *Env) cachedSet(ctx context.Context, key, query string, id int64) (*UserIDs, error) {
	st := e.Stores()
	members, err := st.Redis.SMembers(ctx, key).Result()
	if err != nil {
		return nil, err
	}
	out := &UserIDs{UserIDs: make([]int64, 0, len(members))}
	for _, m := range members {
		if v, err := strconv.ParseInt(m, 10, 64); err == nil {
			out.UserIDs = append(out.UserIDs, v)
		}
	}
	if len(out.UserIDs) > 0 {
		return out, nil
	}
	rows, err := st.Postgres.Query(ctx, query, id)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", key, err)
	}
	if out.UserIDs, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		return nil, fmt.Errorf("read %s: %w", key, err)
	}
	if len(out.UserIDs) > 0 {
		members := make([]any, len(out.UserIDs))
		for i, v := range out.UserIDs {
			members[i] = v
		}
		if err := st.Redis.SAdd(ctx, key, members...).Err(); err != nil {
			return nil, err
		}
	}
	return out, nil
}
